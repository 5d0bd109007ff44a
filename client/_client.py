"""``gradserve.Client``: a channel, a session, and the one wrapper around every call."""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import random
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
import numpy as np
from google.protobuf import message_factory
from google.protobuf.message import Message

from gradserve import codec, dtypes, heap, protocol, warm_buffers
from gradserve.client import _shm
from gradserve.client._convert import OUT_OF_RANGE, cannot_convert, is_plain_python, to_array
from gradserve.client._errors import (
    CHANNEL_GONE,
    answered,
    certificate_rejected,
    dropped,
    from_rpc_error,
    never_sent,
    not_sent,
    server_done,
)
from gradserve.client._fetched import Fetched
from gradserve.client._prefetch import Prefetcher
from gradserve.client._queues import take_all
from gradserve.client._raw_ops import RawOps, Staging
from gradserve.client._tape import GradientTape, Recording
from gradserve.client._types import StepOutput, TapedArray, TensorRef, tape_refs
from gradserve.errors import (
    NOT_CONNECTED_REASON,
    UNRUN_REASONS,
    CancelledError,
    ConversionError,
    DataLossError,
    GradserveError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    UnimplementedError,
)
from gradserve.v1 import service_pb2, service_pb2_grpc, tape_pb2, tensor_pb2
from gradserve.warm_buffers import WarmBuffers

ArrayLike = Any  # np.ndarray, anything np.asarray takes, or a TensorRef
#: gRPC call metadata: (key, value) pairs.
Metadata = Sequence[tuple[str, str]]

log = logging.getLogger(__name__)

#: ``host_cache_bytes``' default: the largest tensor ``make bench`` moves.
DEFAULT_HOST_CACHE_BYTES = 256 << 20

#: While a call is not connected (reason NOT_CONNECTED), how often it is tried again
#: through each backoff pause: such a try fails at once, unsent, until the channel
#: has connected.
CONNECT_POLL_SECONDS = 0.1
#: The least time the SDK's own housekeeping RPCs get (``_call(once=True)``: its
#: shared-memory regions registered and dropped, its deletes), however short the
#: client's ``timeout``: under a timeout of 2 ms, an op's deadline on a busy server cut
#: the unregistering of its regions short too, the server kept them, and after 64 the
#: session refused every new region (a review helper: 648 refusals in 700 calls).
HOUSEKEEPING_TIMEOUT_SECONDS = 1.0

#: How the SDK's own channel connects (``Client.channel_options``).
#:
#: - Its own subchannels, so each Client has its own TCP connection: gRPC otherwise
#:   shares one per address (and channel arguments) among all the channels of a
#:   process, backoff included. A Client then failed at once, with the old
#:   "Connection refused", to a server just started at an address where another
#:   Client of the process had seen a server gone (a restart, or a reused port).
#: - Reconnect backoff of at most 1 s, plus gRPC's 20% jitter (its default grows to
#:   120 s): until the backoff ends every call fails unsent, so a longer one would
#:   keep a write waiting out a restart long after the server is back.
CONNECTION_OPTIONS: list[tuple[str, int]] = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class Backoff:
    """The pauses between one call's attempts: ``retries`` of them, from 0.1 s doubling
    up to 5 s, each times 1-2 (jitter). A pause after an attempt gRPC never sent
    (``unsent``: NOT_CONNECTED) is cut into tries every ``CONNECT_POLL_SECONDS``,
    which cost no retry: the call goes soon after the server is back."""

    def __init__(self, retries: int) -> None:
        self.remaining = retries
        self.delay = 0.1
        self.polls = 0  # unsent: tries left in the pause being polled through
        self.step = 0.0  # and the wait before each

    def next(self, *, unsent: bool) -> float | None:
        """The wait before the next attempt; None when the budget is spent."""
        if not unsent:
            self.polls = 0
        if self.polls > 0:
            self.polls -= 1
            return self.step
        if self.remaining <= 0:
            return None
        self.remaining -= 1
        wait = self.delay * (1 + random.random())
        self.delay = min(2 * self.delay, 5.0)
        if unsent:  # the pause, cut into tries
            self.polls = max(1, math.ceil(wait / CONNECT_POLL_SECONDS)) - 1
            wait = self.step = wait / (self.polls + 1)
        return wait


class Client:
    """A session on a gradserve server.

    Parameters
    ----------
    target:
        ``host:port`` of the server.
    session_id:
        Reattach to this existing session (a restarted worker picking up its
        arrays) instead of creating one; it is then left open on ``close``.
    timeout:
        Default deadline in seconds of each call (None: no deadline).
    stream_threshold:
        Tensors of at least this many bytes travel by the streaming
        PutTensor/GetTensor RPCs instead of inline in the op's message.
    max_message_bytes:
        Unary message ceiling of this channel, both directions. Requests and
        responses are budgeted against it as a whole: inputs that would not fit in
        the request are uploaded first, and the server returns outputs that would
        not fit in the response as transient tensors fetched by stream.
    token:
        Bearer token sent with every call (``authorization`` metadata).
    root_certificates, private_key, certificate_chain:
        PEM bytes: connect with TLS (trusting ``root_certificates``) and, with a
        key and chain, present a client certificate (mutual TLS).
    retries:
        Attempts after the first for calls that are safe to repeat (session
        keep-alive, health, size, StopGradient, LSTM ops without ``keep``,
        tensor fetches and deletes), on UNAVAILABLE, with exponential backoff
        (0.1 s doubling up to 5 s, times 1-2). Writes and clearing reads are
        repeated only when the call did not run: a draining server refused it, a
        proxy forwarded none of it, or this client's channel connected to no
        address (reason ``NOT_CONNECTED``; tried again every 0.1 s through each
        pause, so the repeat goes soon after it connects). A server that stays down
        thus costs a call the whole budget: about 1-2 s at 3, 16-32 s at 8. A
        rejected TLS certificate is never repeated, and ``close`` repeats nothing.
    channel:
        A gRPC channel of your own (e.g. with interceptors) instead of one made
        from ``target`` and the TLS arguments; left open on ``close``. Build it with
        ``Client.channel_options()``. A call that fails on it as not connected is
        not known to be unsent (a retry policy in its service config may have
        sent it first), so a write is then not repeated.
    keepalive:
        Refresh the session in the background while the client is open, so
        that the server's idle timeout does not close it.
    shared_memory:
        Same-host shared memory (``/dev/shm``) instead of the network for inputs of
        at least ``shared_memory_min_bytes``, ``put``/``get`` and the outputs of op
        calls: "auto" uses it once the server proves it shares this host (it reads
        back a nonce written into a fresh region) and the wire otherwise; True
        raises if it cannot be used; False never uses it. String tensors always
        travel on the wire.
    keep_heap_warm:
        Set glibc's malloc thresholds for this process (once; ``gradserve.heap``):
        buffers under 32 MiB come from the heap and up to 128 MiB of freed heap
        stay mapped, so the replies this client receives land in memory touched
        before instead of fresh pages (a 1 MiB put and delete in a loop took
        5.3 ms with glibc's defaults, 1.3-1.7 ms kept warm, here). It costs
        memory: freed memory stays mapped, and the heap fragments more.
        Process-wide: False leaves malloc's settings as they are (another client
        may still set them).
    host_cache_bytes:
        Freed buffers of fetched tensors kept for the next fetch of the same size
        (``gradserve.warm_buffers``, as the server's ``--host-cache-bytes``), for
        tensors above the 32 MiB that a warm heap serves: a 256 MiB ``get`` took
        118 ms into a reused buffer, 150 ms into fresh memory. Buffers unused for a
        minute are dropped (by the keep-alive thread, else at the next fetch), all
        of them on ``close``; 0 keeps none. Without a warm heap, from 4 MiB.

    Every call carries an ``x-request-id`` (also on raised errors as
    ``.request_id``) that the server logs. Use as a context manager: the
    session is closed on exit (when this client created it).
    """

    def __init__(
        self,
        target: str,
        *,
        session_id: str | None = None,
        timeout: float | None = None,
        stream_threshold: int = protocol.DEFAULT_STREAM_THRESHOLD_BYTES,
        max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
        chunk_bytes: int = protocol.DEFAULT_CHUNK_BYTES,
        channel: grpc.Channel | None = None,
        token: str | None = None,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        retries: int = 3,
        keepalive: bool = True,
        shared_memory: bool | str = "auto",
        shared_memory_min_bytes: int = _shm.DEFAULT_MIN_BYTES,
        keep_heap_warm: bool = True,
        host_cache_bytes: int = DEFAULT_HOST_CACHE_BYTES,
    ) -> None:
        if keep_heap_warm:
            heap.keep_warm()
        #: Buffers for fetched tensors (see ``host_cache_bytes``): those a warm heap
        #: does not serve.
        self._buffers = WarmBuffers(
            host_cache_bytes,
            min_bytes=heap.MMAP_THRESHOLD_BYTES if heap.is_warm() else warm_buffers.MIN_BYTES,
        )
        self.target = target
        self.timeout = timeout
        self.stream_threshold = stream_threshold
        #: Tensor bytes one message may carry (the rest of it: field tags, names): a
        #: response (this channel's receive limit), and a request (the smaller of this
        #: channel's and the server's limits, learnt from KeepAlive).
        self.max_message_bytes = max_message_bytes
        self.inline_budget = max(0, max_message_bytes - protocol.MESSAGE_OVERHEAD_BYTES)
        #: The server's ``--max-inline-reply-bytes`` (``KeepAlive``): a get of more is
        #: streamed without asking for it inline first (a refused call each).
        self._server_inline_reply = self.inline_budget
        #: The largest request both ends take (the server's limit comes with KeepAlive).
        self.request_limit = max_message_bytes
        self.request_budget = self.inline_budget
        self.chunk_bytes = chunk_bytes
        if retries < 0:
            raise ValueError(f"retries must be 0 or more, not {retries}")
        self.retries = retries
        self._own_channel = channel is None
        if channel is None:
            options = self.channel_options(max_message_bytes)
            if root_certificates or private_key or certificate_chain:
                creds = grpc.ssl_channel_credentials(
                    root_certificates, private_key, certificate_chain
                )
                channel = grpc.secure_channel(target, creds, options=options)
            else:
                channel = grpc.insecure_channel(target, options=options)
        self._channel = channel
        self._stub = _stub(self._channel)
        self._auth: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self._closed = False
        #: Set just before ``close`` closes the channel (calls in flight then end
        #: CANCELLED: not the server's doing).
        self._channel_closed = False
        #: Set when ``close`` begins: the keep-alive thread stops, pauses between
        #: attempts end, and no call is repeated (a server that is down must not hold
        #: ``close`` for the whole retry budget).
        self._closing = threading.Event()
        self._shm: _shm.ClientSharedMemory | None = None
        #: Transient outputs read in full, for the next call to delete (``_fetched``),
        #: when the server says it does (``KeepAlive``); an older one deletes them as
        #: it sends them (``delete_after``).
        self._fetched = Fetched(self._delete_fetched)
        self._server_deletes_fetched = False
        self._prefetcher = Prefetcher(functools.partial(self._fetch, delete_after=True))
        #: The server has PutTensorInline/GetTensorInline (until one says UNIMPLEMENTED).
        self._unary_tensors = True
        #: The gradient tapes recording on each thread (``gradient_tape``).
        self._recording = Recording()
        #: Ids of tapes garbage collected unreleased (``_tape._dropped``): released
        #: by the next call (``_release_dropped``).
        self._dropped_tapes: collections.deque[str] = collections.deque()
        #: Ids of the uploads of batches dropped without ``run()`` (``Batch.__del__``,
        #: which runs inside whatever call a garbage collection interrupts, so it only
        #: appends): deleted by the next call (``_delete_dropped_uploads``).
        self._dropped_uploads: collections.deque[str] = collections.deque()
        #: Batches made and still referenced (``_needed_by_batches``).
        self._batches: weakref.WeakSet[Any] = weakref.WeakSet()
        self._batches_lock = threading.Lock()
        #: Gradient tapes made and still referenced: a client closing in a session it
        #: did not create releases them (the session stays).
        self._tapes: weakref.WeakSet[Any] = weakref.WeakSet()
        self._tapes_lock = threading.Lock()
        if session_id is None:
            reply = self._call("CreateSession", service_pb2.CreateSessionRequest(), session=False)
            self.session_id: str = reply.session_id
            self.owns_session = True
        else:
            self.session_id = session_id
            self.owns_session = False
        self._metadata = (
            *self._auth,
            (protocol.SESSION_METADATA_KEY, self.session_id),
            (protocol.INLINE_LIMIT_METADATA_KEY, str(stream_threshold)),
            (protocol.RESPONSE_BUDGET_METADATA_KEY, str(self.inline_budget)),
        )
        idle_timeout = self.keep_alive()  # for a reattach: NotFoundError now, not later
        if keepalive:
            self._start_keepalive(idle_timeout)
        self.raw_ops = RawOps(self, self._run_op, self._staging)
        try:
            self._shm = _shm.ClientSharedMemory.connect(
                self._call_recovering,
                shared_memory,
                shared_memory_min_bytes,
                housekeeping=functools.partial(self._call, once=True),
            )
        except BaseException:
            self.close()
            raise

    @staticmethod
    def channel_options(
        max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
    ) -> list[tuple[str, int]]:
        """The options of the channel a Client makes (its message limits and how it
        connects, ``CONNECTION_OPTIONS``), for a channel of your own."""
        return protocol.channel_options(max_message_bytes) + CONNECTION_OPTIONS

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the session (if this client created it) and the channel."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._fetched.close()
        try:
            if self._shm is not None:  # the session's close unregisters its regions
                self._shm.close(unregister=not self.owns_session)
            if not self.owns_session:  # the session stays: free what this client fetched
                with self._batches_lock:  # and what its batches uploaded: none can run now
                    batches = list(self._batches)
                for batch in batches:
                    self._dropped_uploads.extend(batch._abandon())
                self._delete_dropped_uploads()
                self._release_tapes_left()
                self._fetched.flush()
            else:
                self._dropped_tapes.clear()  # the session's close frees them
                self._dropped_uploads.clear()
                try:  # once (``_closing``): a server that is down frees it when idle
                    self._call("CloseSession", service_pb2.CloseSessionRequest())
                except NotFoundError:
                    pass  # already gone (expired, or the server restarted): nothing to free
                except UnavailableError as e:
                    # The server is unreachable; its idle timeout frees the session.
                    log.warning("could not close session %s…: %s", self.session_id[:8], e)
        finally:
            self._prefetcher.close()
            self._buffers.limit_bytes = 0  # what returns later (arrays still held) is dropped
            self._buffers.clear()
            if self._own_channel:
                self._channel_closed = True
                self._channel.close()

    def keep_alive(self) -> float:
        """Refresh the session's idle timer; returns the server's idle timeout (s).

        The reply also names the server's message limit: requests (and streamed
        chunks) are budgeted against the smaller of it and this channel's; and its
        inline reply limit, past which a get streams at once."""
        md = (*self._auth, (protocol.SESSION_METADATA_KEY, self.session_id))
        reply = self._call("KeepAlive", service_pb2.KeepAliveRequest(), metadata=md)
        self._server_deletes_fetched = reply.deletes_fetched
        if reply.HasField("max_inline_reply_bytes"):  # (an older server: none said)
            self._server_inline_reply = reply.max_inline_reply_bytes
        if reply.max_message_bytes:
            self.request_limit = min(self.max_message_bytes, reply.max_message_bytes)
            self.request_budget = max(0, self.request_limit - protocol.MESSAGE_OVERHEAD_BYTES)
        return reply.idle_timeout_seconds

    def _start_keepalive(self, idle_timeout: float) -> None:
        interval = max(0.05, min(60.0, idle_timeout / 3))

        def loop() -> None:
            while not self._closing.wait(interval):
                self._buffers.expire_idle()
                try:
                    self.keep_alive()
                except GradserveError as e:  # the next op reports a lost session
                    log.debug("background keep-alive failed: %s", e)

        threading.Thread(target=loop, name="gradserve-keepalive", daemon=True).start()

    def health(self, service: str = "") -> str:
        """The server's health status name (SERVING, NOT_SERVING, ...)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)

        def check():
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)

        reply = self._with_retries(check, safe=True)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    # ---------------------------------------------------------------- calls
    def _call(
        self,
        rpc: str,
        request: Any,
        *,
        session: bool = True,
        metadata: Metadata | Callable[[bool], Metadata | None] | None = None,
        timeout: float | None = None,
        tapes: Sequence[Any] | None = None,
        once: bool = False,
    ) -> Any:
        """Invoke ``rpc``; a failure raises its ``gradserve.errors`` class (repeated as
        ``_with_retries`` says; with ``once``, never: the SDK's own housekeeping within
        other calls, its shared-memory regions and deletes, so that a server that is
        down costs a call one retry budget, not one per nested call; and given at least
        ``HOUSEKEEPING_TIMEOUT_SECONDS``, so that the deadline that cut the call short
        does not cut its cleanup short too). An op records on
        ``tapes`` (default: the tapes recording on this thread). ``metadata`` may be
        a function, called for each
        attempt with whether the last attempt may have reached the server (an op's
        output region: see ``_run_op``). So may ``request``, which a request stream
        must be: an attempt consumes its iterator, and a repeat needs the whole stream
        again."""
        if self._dropped_tapes and session and rpc != "ReleaseTape":
            self._release_dropped()
        if self._dropped_uploads and session and rpc != "DeleteTensor":
            self._delete_dropped_uploads()
        default = self._metadata if session else self._auth
        if tapes is None:
            tapes = self._recording.tapes if session and rpc in _RECORDED else ()
        tapes = tuple(tapes)
        recorded = bool(tapes)
        extra = ((protocol.TAPE_METADATA_KEY, self._recording.ids(tapes)),) if recorded else ()
        method = getattr(self._stub, rpc)
        timeout = timeout if timeout is not None else self.timeout
        if once and timeout is not None:
            timeout = max(timeout, HOUSEKEEPING_TIMEOUT_SECONDS)

        sent_before = False  # the last attempt may have reached the server
        ever_sent = False  # any attempt may have

        def attempt():
            nonlocal sent_before, ever_sent
            fetched = self._fetched.take() if session else []
            try:
                if fetched and len(self._fetched) and not self._fetched.out_of_reach:
                    self._fetched.flush()  # more than a call carries: the rest first
                base = metadata(sent_before) if callable(metadata) else metadata
                sent = (*(default if base is None else base), *extra, _request_id())
                if fetched:  # the server deletes them first (client/_fetched.py)
                    sent = (*sent, (protocol.FETCHED_METADATA_KEY, ",".join(fetched)))
                if recorded:
                    # What its outputs' TapedArrays belong to; set after the calls above
                    # (``metadata()`` may register a new output region), and only by
                    # calls that record: the uploads of its inputs and the fetches of
                    # its outputs, nested in this one, set it to none, and its outputs
                    # came back tied to no tape (found by a review helper: an input of
                    # 4 MiB or more over TCP made ``tape.gradient`` silently None).
                    self._recording.call_tapes = tape_refs(tapes)
                body = request() if callable(request) else request
                sent_before = True
                for tape in tapes:  # the server may start it even if the call fails
                    tape.life.proposed = True
                reply = method(body, metadata=sent, timeout=timeout)
                for tape in tapes:
                    tape.life.started = True  # (see ``GradientTape.header``)
                return reply
            except BaseException as e:
                if isinstance(e, grpc.RpcError) and self._own_channel and not_sent(e):
                    sent_before = False  # gRPC sent nothing
                ever_sent |= sent_before
                self._fetched.give_back(fetched)
                raise

        # A call that records on a tape is not repeated blindly: it would record twice.
        safe = _safe_to_repeat(rpc, request) and not recorded
        try:
            return self._with_retries(attempt, safe=safe, once=once)
        except GradserveError as e:
            raise (e if ever_sent else never_sent(e)) from None

    def _with_retries(self, attempt: Callable[[], Any], *, safe: bool, once: bool = False) -> Any:
        """Run ``attempt``; repeat it on UNAVAILABLE with exponential backoff when ``safe``,
        or whatever it is when it did not run (reason ``DRAINING``: a replica shutting
        down refused it; ``NOT_FORWARDED``: a proxy reached no replica;
        ``NOT_CONNECTED``: this client's own channel connected to no address, so gRPC
        sent nothing. The repeat reaches the replica again once restarted, or another
        one for a new session). Not connected, the call is tried again every
        ``CONNECT_POLL_SECONDS`` through each backoff pause (such an attempt fails at
        once, unsent, until the channel connects), so the repeat goes soon after the
        server is back, not at the end of the pause (``Backoff``; not by waiting on
        ``channel_ready_future``, whose poller thread raises "Channel closed!" when
        the client closes under it). A rejected TLS certificate is raised at once. Once ``close`` has begun, nothing is repeated, and pauses end. With
        ``once``, nothing is repeated either.

        An unsafe call that failed UNAVAILABLE otherwise may or may not have been
        applied: it is never repeated, and its error says so. A call that ended
        CANCELLED was dropped by the server or a proxy and counts as UNAVAILABLE
        (``dropped``), unless its channel was closed under it (``close`` from another
        thread): that is CancelledError, never repeated, as is any call after it."""
        backoff = Backoff(0 if once else self.retries)
        while True:
            try:
                result = attempt()
                self._fetched.reachable()
                return result
            except ValueError as e:  # gRPC Python: "Cannot invoke RPC on closed channel!"
                if self._channel_closed or "closed channel" in str(e):
                    raise CancelledError("the client is closed: its channel was closed") from None
                raise
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.CANCELLED and (
                    self._channel_closed or e.details() in CHANNEL_GONE
                ):
                    raise CancelledError(
                        f"the call was cancelled: its channel was closed ({e.details()})"
                    ) from None
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    if code != grpc.StatusCode.DEADLINE_EXCEEDED:  # (may be this side's)
                        self._fetched.reachable()  # the server answered
                    raise from_rpc_error(e) from None
                err = from_rpc_error(e, unsent_is_known=self._own_channel)
                if code == grpc.StatusCode.CANCELLED:
                    err = dropped(err)
                self._fetched.resend_recent()  # (the server may have restarted)
                unrun = err.reason in UNRUN_REASONS
                repeat = (safe or unrun) and not certificate_rejected(err)
                if repeat and not self._closing.is_set():
                    wait = backoff.next(unsent=err.reason == NOT_CONNECTED_REASON)
                    if wait is not None:
                        self._pause(wait)
                        if not self._closing.is_set():  # else close() ended the pause
                            continue
                if not (safe or unrun):
                    err.message = OUTCOME_UNKNOWN + err.message
                    err.args = (err.message,)
                raise err from None

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` before trying a call again; less once ``close`` begins."""
        self._closing.wait(seconds)

    def _staging(self) -> Staging:
        """A new request's temporary uploads and inline budget."""
        return Staging(self.request_budget)

    def _run_op(self, rpc: str, request: Message, parse: Callable[[Any], Any], temps: Staging):
        shm = self._shm  # outputs into a leased region, when on the same host
        out = None
        if shm is not None:  # a region large enough for what the op says it returns
            shm.pool.note_output_need(_shm.aligned_total(temps.output_sizes))
            out = shm.output_lease()
        failure: BaseException | None = None

        def metadata(sent_before: bool) -> Metadata | None:
            """The output region for this attempt: a call repeated after an attempt
            that may have reached the server (UNAVAILABLE) gets a fresh one, as that
            attempt may still write its own; after one gRPC never sent (NOT_CONNECTED,
            tried every 0.1 s while the server is down) it keeps it."""
            if shm is None or out is None:
                return None
            if sent_before:
                out.renew_output()
            return shm.output_metadata(out, self._metadata)

        try:
            try:
                reply = self._call_recovering(rpc, request, metadata=metadata)
            except BaseException as e:
                failure = e
                raise
            finally:
                temps.tapes_named.clear()  # sent: an exception's frames must not pin them
                temps.outputs_named.clear()
                self._clean_up(temps, failure=failure)
            if shm is None or out is None:
                return self._parse(reply, parse)
            with shm.outputs_in_place(out, reply):  # large outputs: views, no copy
                result = self._parse(reply, parse)
            shm.note_reply(reply)
            return result
        finally:
            if out is not None:
                out.release() if server_done(failure) else out.discard()
            failure = None  # (a cycle through its frames kept the call's tapes until a GC)

    def _call_recovering(self, rpc: str, request: Any, **options: Any) -> Any:
        """``_call``, repeated once after the server said it does not know one of the
        shared-memory regions the request names (it restarted, or took the session
        over from another replica: nothing ran), with the regions registered again.
        For every call that may send tensors through regions: ops, ``Gradients``."""
        try:
            return self._call(rpc, request, **options)
        except NotFoundError as e:
            if self._shm is None or not self._shm.recover(e):
                raise
            return self._call(rpc, request, **options)

    def _parse(self, reply: Message, parse: Callable[[Any], Any]) -> Any:
        """``parse(reply)``; if it fails (a transient output could not be fetched), the
        reply's transient outputs are deleted rather than left holding bytes."""
        try:
            with self._prefetcher.prefetching(reply):  # transient outputs, 2 at a time
                return parse(reply)
        except BaseException:
            self._clean_up(transient_ids(reply))
            raise

    # ---------------------------------------------------------------- tensors in/out
    def encode_input(
        self,
        value: ArrayLike,
        msg: tensor_pb2.TensorInput,
        temps: Staging,
        dtype: dtypes.DTypeLike | None = None,
    ) -> None:
        """Fill ``msg`` with ``value``: a ref, inline bytes, or a temporary upload when
        it is large or would not fit in the request (``temps``' inline budget)."""
        if isinstance(value, TensorRef):
            msg.ref = value.id
            return
        if isinstance(value, StepOutput):
            temps.placeholders.append(value)
            msg.step_output.step, msg.step_output.field = value.step, value.field
            return
        if isinstance(value, TapedArray) and value.tape_id is not None and value.held:
            msg.ref = value.tape_id  # the tensor the tape holds: differentiable onwards
            tapes = value.live_tapes()
            temps.tapes_named += tapes
            temps.outputs_named.append((value, tuple(t.life for t in tapes)))
            return
        array = to_array(value, dtype)  # as tf.convert_to_tensor converts it
        if dtype is not None:
            if array.size and is_plain_python(value):
                if array.dtype.kind in "fcUS":
                    # tf.raw_ops refuses a Python float or string for an integer input
                    # (it truncates a NumPy float, which the server refuses:
                    # _as_integer_input); an empty list is the input's type.
                    raise TypeError(cannot_convert(value, dtype))
                if array.dtype.kind == "u":  # NumPy's reading of an int past int64
                    raise ConversionError(OUT_OF_RANGE)  # (past uint64: _as_integer_input)
            array = _as_integer_input(array, dtypes.normalize(dtype))
        nbytes = dtypes.nbytes(array)
        size = protocol.encoded_size(nbytes, array.ndim)
        if self._shm is not None and self._shm.encode_input(array, msg, temps):
            return
        if nbytes >= self.stream_threshold or size > temps.inline_left:
            ref = self.put(array)
            temps.append(ref.id)
            msg.ref = ref.id
        else:
            temps.inline_left -= size
            codec.encode(array, msg.value)

    def decode_output(self, msg: tensor_pb2.TensorOutput) -> np.ndarray | TensorRef:
        """An array for inline or transient outputs (a scalar one as a NumPy scalar, a
        string one as ``bytes``, as TensorFlow's ``.numpy()`` gives them); a
        ``TensorRef`` for kept ones. An output computed under a gradient tape comes as
        a ``TapedArray`` (a 0-d one too: it carries the tape's id)."""
        if msg.WhichOneof("result") == "value":
            value = codec.decode(msg.value, field="output")
        elif msg.WhichOneof("result") == "shared" and self._shm is not None:
            value = self._shm.read_output(msg)
        elif msg.ref.transient:
            prefetched = self._prefetcher.take(msg.ref.id)
            value = (
                prefetched if prefetched is not None else self._fetch(msg.ref.id, delete_after=True)
            )
        else:
            ref = msg.ref
            return TensorRef(self, ref.id, codec.dtype_from_enum(ref.dtype), tuple(ref.shape))
        if msg.tape_id:
            return TapedArray.wrap(value, msg.tape_id, self._recording.call_tapes)
        if value.ndim == 0:  # as TensorFlow's .numpy(): np.float32(1.5), b"ab"
            return value[()]
        return value

    def put(self, array: ArrayLike) -> TensorRef:
        """Keep ``array`` in the session (one message below ``stream_threshold``, else
        streamed in chunks; by shared memory on the same host); returns its reference."""
        array = to_array(array)
        if self._shm is not None and (reply := self._shm.put(array)) is not None:
            return TensorRef(self, reply.id, dtypes.normalize(array.dtype), tuple(reply.shape))
        nbytes = dtypes.nbytes(array)
        if (
            self._unary_tensors
            and nbytes < self.stream_threshold
            and protocol.encoded_size(nbytes, array.ndim) <= self.request_budget
        ):  # one unary call: cheaper than a stream
            try:
                reply = self._call("PutTensorInline", codec.serialize_tensor(array))
                return TensorRef(self, reply.id, dtypes.normalize(array.dtype), tuple(reply.shape))
            except UnimplementedError:  # an older server: streams only
                self._unary_tensors = False
        chunk_bytes = max(
            1, min(self.chunk_bytes, self.request_limit - protocol.CHUNK_HEADER_BYTES)
        )
        # At least 4 chunks (of 64 KiB or more): the server takes in one while the next
        # is on its way, and gRPC Python receives one 1 MiB message slower than four.
        chunk_bytes = min(chunk_bytes, max(_MIN_CHUNK_BYTES, nbytes // 4))
        content = codec.WireContent(array)
        reply = self._call("PutTensor", lambda: content.encoded_chunks(chunk_bytes))
        return TensorRef(self, reply.id, dtypes.normalize(array.dtype), tuple(reply.shape))

    def get(self, ref: TensorRef | str) -> np.ndarray:
        """Fetch a resident tensor (as ``put`` sends one).

        Through shared memory, a large tensor comes back without a copy: the array
        lives in a region of this client that stays the caller's while the array (or
        a view of it) lives; it is writable and the server's tensor is unaffected.
        """
        if self._shm is not None and isinstance(ref, TensorRef):
            value = self._shm.get(ref.id, ref.dtype, ref.shape)
            if value is not None:
                return value
        if (
            self._unary_tensors
            and isinstance(ref, TensorRef)
            and ref.dtype != dtypes.STRING
            and ref.nbytes < self.stream_threshold
            and protocol.encoded_size(ref.nbytes, len(ref.shape))
            <= min(self.inline_budget, self._server_inline_reply)
        ):  # one unary call: cheaper than a stream
            request = service_pb2.GetTensorRequest(id=ref.id)
            try:
                reply = self._call("GetTensorInline", request)
                return codec.decode(reply, field="GetTensorInline")
            except UnimplementedError:  # an older server: streams only
                self._unary_tensors = False
            except ResourceExhaustedError as e:  # a server that budgets it larger
                if e.reason != "USE_GET_TENSOR":
                    raise
        return self._fetch(ref.id if isinstance(ref, TensorRef) else ref, delete_after=False)

    def delete(self, *refs: TensorRef | str) -> int:
        """Free resident tensors; returns how many existed."""
        return self._delete_ids([r.id if isinstance(r, TensorRef) else r for r in refs])

    def _delete_fetched(self, ids: list[str]) -> int:
        """``Fetched``'s deletes: housekeeping, often inside another call, tried once
        (what fails waits for the next call to carry it)."""
        return self._delete_ids(ids, once=True)

    def _delete_ids(self, ids: Iterable[str], *, once: bool = False) -> int:
        """Delete tensors by id, in as many requests as the message limit and the
        server's field limit need (each tried ``once``, for housekeeping inside
        another call: ``_call``)."""
        deleted, size = 0, 0
        batch: list[str] = []
        for tensor_id in [*ids, None]:
            if (
                tensor_id is None
                or size + len(tensor_id) + 8 > self.request_budget
                or len(batch) >= protocol.MAX_REQUEST_FIELDS
            ):
                if batch or tensor_id is None:
                    request = service_pb2.DeleteTensorRequest(ids=batch)
                    deleted += self._call("DeleteTensor", request, once=once).deleted
                batch, size = [], 0
            if tensor_id is not None:
                batch.append(tensor_id)
                size += len(tensor_id) + 8
        return deleted

    def _clean_up(self, ids: list[str], *, failure: BaseException | None = None) -> None:
        """Delete temporary uploads after a call (``failure``: what it raised); a
        failure here is logged, not raised, so it never hides the call's own result or
        error (the session's idle timeout frees what could not be deleted).
        Shared-memory leases are discarded, not reused, unless the server is done with
        the call (``server_done``): it may still be reading them. If the server did
        not answer, it may well be down: the deletes are tried once."""
        if self._shm is not None:
            ids = self._shm.release_temps(ids, discard=not server_done(failure))
        if not ids:
            return
        try:
            once = failure is not None and not answered(failure)
            self._delete_ids(ids, once=once)
        except GradserveError as e:
            log.warning("could not delete %d temporary tensor(s): %s", len(ids), e)

    def _fetch(self, tensor_id: str, *, delete_after: bool) -> np.ndarray:
        """The whole stream, repeated on UNAVAILABLE. With ``delete_after`` (a transient
        output) the tensor is deleted once this client holds all of it, by its next
        call (``_fetched``), not by the server as it sends the last chunk: a stream that
        breaks after that would have lost it. A server that does not say it deletes
        fetched ids (``KeepAlive``: an older one) deletes as it sends."""
        self._buffers.expire_idle()  # also the keep-alive thread's, when there is one
        chunk = max(1, min(self.chunk_bytes, self.max_message_bytes - protocol.CHUNK_HEADER_BYTES))
        by_next_call = delete_after and self._server_deletes_fetched
        request = service_pb2.GetTensorRequest(
            id=tensor_id, chunk_bytes=chunk, delete_after=delete_after and not by_next_call
        )

        def attempt() -> np.ndarray:
            stream = self._stub.GetTensor(
                request, metadata=(*self._metadata, _request_id()), timeout=self.timeout
            )
            try:
                return codec.decode_chunks(stream, allocate=self._buffers.empty, field="GetTensor")
            except InvalidArgumentError as e:  # the server sent a broken stream
                raise DataLossError(str(e)) from None

        value = self._with_retries(attempt, safe=True)
        if by_next_call:
            self._fetched.add(tensor_id)
        return value

    # ---------------------------------------------------------------- Pythonic layer
    def tensor_array(self, dtype: dtypes.DTypeLike, size: int = 0, **kwargs):
        """A ``tf.TensorArray``-style object on the server (see ``gradserve.TensorArray``)."""
        from gradserve.client._tensor_array import TensorArray

        return TensorArray(self, dtype, size, **kwargs)

    def stop_gradient(self, x: ArrayLike) -> np.ndarray:
        """``tf.stop_gradient``: returns ``x`` unchanged, bit for bit."""
        return self.raw_ops.StopGradient(input=x)

    def gradient_tape(
        self, persistent: bool = False, watch_accessed_variables: bool = True
    ) -> GradientTape:
        """A gradient tape recording on the server: ``with client.gradient_tape() as
        tape: ...`` then ``tape.gradient(target, sources)`` (``tf.GradientTape``)."""
        return GradientTape(self, persistent, watch_accessed_variables)

    def _release_dropped(self, *, closing: bool = False) -> None:
        """Release the tapes garbage collected unreleased, before the call that found
        them: TensorFlow frees a tape its program drops, and a loop that never called
        ``release()`` ran into the session's 64 tapes (a review helper). Each is one
        ReleaseTape; one that fails (the tape or session already gone) is logged.

        The ids queued now are taken first, and only then what batches need: a
        recording is queued (a reset, a tape entered again) after the steps that name
        it were added, so one taken here is either needed already or never will be
        (needs read first, another thread's reset could release what its batch had
        just named: helper-74). ``closing``: no batch of this client can run any more,
        so none is held back."""
        pending = take_all(self._dropped_tapes)
        needed = set() if closing else self._needed_by_batches()
        try:
            while pending:
                tape_id = pending.pop()
                if tape_id in needed:
                    self._dropped_tapes.append(tape_id)  # after the batches that need it
                    continue
                try:
                    request = tape_pb2.ReleaseTapeRequest(tape_id=tape_id)
                    self._call("ReleaseTape", request, once=True)
                except GradserveError as e:
                    log.info("could not release a dropped gradient tape: %s", e)
        finally:
            self._dropped_tapes.extend(pending)  # (an interrupt: the rest next time)

    def _release_tapes_left(self) -> None:
        """Closing in a session this client did not create: release the recordings its
        tapes hold there, live or dropped (they held the session's bytes until it
        ended; ``release()`` after ``close()`` has nothing to send: helper-79). Each
        is tried once; a failure is logged."""
        with self._tapes_lock:
            tapes = list(self._tapes)
        for tape in tapes:
            life = tape.life
            if (life.started or life.proposed) and not life.released:
                try:
                    tape.release_on_server()
                except GradserveError as e:
                    log.info("could not release a gradient tape on closing: %s", e)
        self._release_dropped(closing=True)

    def _delete_dropped_uploads(self) -> None:
        """Delete the uploads of batches dropped unrun: they held the session's bytes
        until it ended (a worker whose loop raised between recording and ``run()``
        leaked one batch's inputs per failure). A server that deletes the ids a call
        names (``x-gradserve-fetched``) does so before the call that found them, at no
        round trip of its own; an older one gets a DeleteTensor (tried once; what
        fails waits for the next call)."""
        ids = take_all(self._dropped_uploads)
        if not ids:
            return
        if self._server_deletes_fetched:
            self._fetched.add(*ids)
            return
        try:
            self._delete_ids(ids, once=True)
        except GradserveError as e:
            log.warning("could not delete %d upload(s) of a dropped batch yet: %s", len(ids), e)
            self._dropped_uploads.extend(ids)

    def _needed_by_batches(self) -> set[str]:
        """The recordings of tapes that batches not yet run (or running) record steps
        on or name outputs of: a recording reset, or left by entering the tape again,
        is released only once they have run (helper-72: the batch's own call released
        it first, and its steps failed NOT_FOUND)."""
        with self._batches_lock:  # (a WeakSet changed while iterated raises)
            batches = list(self._batches)
        return {tape_id for batch in batches for tape_id in batch.needs()}

    def batch(self):
        """Collect ops (``b.raw_ops.X(...)``) and run them in one round trip with ``b.run()``."""
        from gradserve.client._batch import Batch

        batch = Batch(self)
        with self._batches_lock:
            self._batches.add(batch)
        return batch

    def __repr__(self) -> str:
        return f"Client({self.target!r}, session_id={self.session_id[:8]}…)"


#: The start of the message of an unsafe call that failed UNAVAILABLE in flight.
OUTCOME_UNKNOWN = (
    "outcome unknown: the server became unreachable while this call was in flight, so "
    "it may or may not have been applied; it was not repeated (repeating a write could "
    "apply it twice). Check the state (e.g. read the element back) before writing again. "
)

#: Requests the codec serializes itself, straight from the array: one copy
#: (``WireContent.encoded_chunks``, ``codec.serialize_tensor``).
_SERIALIZERS: dict[str, Callable[[Any], bytes]] = {
    "PutTensor": codec.serialize,
    "PutTensorInline": codec.serialize,
}
#: Replies whose tensors are read from the bytes received, not copied into a message
#: and out again; op replies too (``codec.reply_parser``).
_PARSERS: dict[str, Callable[[bytes], Any]] = {
    "GetTensorInline": codec.parse_tensor,
    "GetTensor": codec.parse_chunk,
}


def _stub(channel: grpc.Channel) -> Any:
    """The generated stub, its methods that move tensors replaced by ones with the
    codec's serializers and parsers (as the server's ``app.VIEW_PARSERS``)."""
    stub = service_pb2_grpc.GradServeStub(channel)
    service = service_pb2.DESCRIPTOR.services_by_name["GradServe"]
    for method in service.methods:
        request = message_factory.GetMessageClass(method.input_type)
        reply = message_factory.GetMessageClass(method.output_type)
        serialize = _SERIALIZERS.get(method.name, request.SerializeToString)
        parse = _PARSERS.get(method.name) or codec.reply_parser(reply)
        if serialize == request.SerializeToString and parse == reply.FromString:
            continue  # the generated method does the same
        kind = "_".join(
            "stream" if streaming else "unary"
            for streaming in (method.client_streaming, method.server_streaming)
        )
        setattr(
            stub,
            method.name,
            getattr(channel, kind)(
                f"/{service.full_name}/{method.name}",
                request_serializer=serialize,
                response_deserializer=parse,
            ),
        )
    return stub


#: RPCs that record on the gradient tapes active when they are called.
_RECORDED = (set(protocol.BATCH_FIELDS) | {"Batch"}) - {"Gradients", "WatchTensors"}

#: The smallest chunk ``put`` cuts (the server's floor as well).
_MIN_CHUNK_BYTES = 64 * 1024


#: RPCs that change nothing on the server, or change it the same way twice.
_IDEMPOTENT = {"KeepAlive", "TensorArraySizeV3", "DeleteTensor", "GetTensorInline"}
#: Pure computations: safe unless they keep their outputs in the session.
_PURE = {"StopGradient", "BlockLSTMV2", "BlockLSTMGradV2", "BlockLSTM", "BlockLSTMGrad"}


def _safe_to_repeat(rpc: str, request: Any) -> bool:
    if rpc in _IDEMPOTENT:
        return True
    return rpc in _PURE and not getattr(request, "keep_outputs", False)


def _request_id() -> tuple[str, str]:
    return (protocol.REQUEST_ID_KEY, os.urandom(8).hex())


def transient_ids(message: Message) -> list[str]:
    """The ids of the transient outputs anywhere in a reply (a Batch's included)."""
    ids = []
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        values = [value] if isinstance(value, Message) else value
        for item in values:
            if isinstance(item, tensor_pb2.TensorOutput):
                if item.WhichOneof("result") == "ref" and item.ref.transient:
                    ids.append(item.ref.id)
            else:
                ids.extend(transient_ids(item))
    return ids


def _as_integer_input(array: np.ndarray, target: np.dtype) -> np.ndarray:
    """Integers (and empty lists) in ``target``'s width, refusing silent wrap-around.

    Anything else is sent as it is, for the server to reject with the op's message.
    """
    if array.dtype == object and any(isinstance(v, int) for v in array.flat):
        raise ConversionError(OUT_OF_RANGE)  # past int64 (and uint64): TensorFlow's
    if array.dtype == target or not (array.size == 0 or array.dtype.kind in "iub"):
        return array
    converted = array.astype(target)
    if (
        array.size == 1
        and converted.item() != array.item()
        or (array.size > 1 and not np.array_equal(converted, array))
    ):
        raise InvalidArgumentError(f"{array.tolist()!r} does not fit in {target}")
    return converted


__all__ = ["Client", "GradserveError"]
